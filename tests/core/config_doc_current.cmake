# Fails when the committed docs/config.md differs from what this build's `lcx-train config
# --markdown` prints: the reference comes from the code that reads each key, the doc from it.
# Run as: cmake -DLCX_TRAIN=<lcx-train> -DDOC=<repo>/docs/config.md -P config_doc_current.cmake
execute_process(COMMAND ${LCX_TRAIN} config --markdown OUTPUT_VARIABLE generated ERROR_VARIABLE errors
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "lcx-train config --markdown failed (exit ${rc}):\n${errors}")
endif()
set(fix "regenerate it: build/bin/lcx-train config --markdown > docs/config.md (after building every plugin)")
if(NOT EXISTS ${DOC})
  message(FATAL_ERROR "${DOC} is missing: ${fix}")
endif()
file(READ ${DOC} committed)
if(NOT committed STREQUAL generated)
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/config.md.generated "${generated}")
  message(FATAL_ERROR "${DOC} differs from `lcx-train config --markdown` of this build "
                      "(written to ${CMAKE_CURRENT_BINARY_DIR}/config.md.generated; diff the two): ${fix}")
endif()
message(STATUS "${DOC} is current")
