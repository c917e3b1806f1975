# Writes OUT, a header defining LCX_GIT_HASH (the checkout's short hash, "unknown" outside one),
# only when the hash changed: run at every build (core/CMakeLists.txt), so lcx-train's version line
# names the commit it was built from, and only the one file that includes the header recompiles.
#   cmake -DSRC=<source dir> -DOUT=<header> -P lcx_git_hash.cmake
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE hash OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT hash)
  set(hash unknown)
endif()
set(text "#pragma once\n#define LCX_GIT_HASH \"${hash}\"\n")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
  if(old STREQUAL text)
    return()
  endif()
endif()
file(WRITE ${OUT} "${text}")
