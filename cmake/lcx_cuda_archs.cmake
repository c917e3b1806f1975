# Which GPUs the build makes machine code for: the configure variable LCX_CUDA_ARCHS.
#   all     sm_80 (A100), sm_86 (RTX 30xx, A40), sm_89 (L40S, RTX 40xx and 6000 Ada), sm_90a (H100,
#           H200) and sm_100 (B200) machine code, plus compute_100 PTX that the driver compiles for
#           GPUs newer than all of them. What a release ships (scripts/release.sh).
#   native  this machine's GPUs (nvidia-smi's compute capabilities), for developers: one target
#           builds fastest. Without a visible GPU (CI) it is sm_90 machine code and compute_90 PTX.
#   a list  CMake's CUDA_ARCHITECTURES spelling, e.g. "80-real;90-real".
# CMAKE_CUDA_ARCHITECTURES given on the command line wins over all of these.
# The Hopper kernels (*_sm90a.cu: wgmma, setmaxnreg, TMA) build for sm_90a alone whatever is chosen:
# nothing else can run them, and the attention dispatch reaches them only on a compute capability 9.0
# device. sm_80 is the floor: lcx's kernels compute in bf16, which earlier GPUs lack.
set(LCX_CUDA_ARCHS native CACHE STRING
    "GPU targets: all (sm_80 to sm_100 and PTX), native (this machine's GPU; sm_90 without one), or a CUDA_ARCHITECTURES list")
set(LCX_CUDA_ARCHS_ALL 80-real 86-real 89-real 90a-real 100-real 100-virtual)
set(LCX_CUDA_ARCHS_NO_GPU 90)

# Sets CMAKE_CUDA_ARCHITECTURES from LCX_CUDA_ARCHS (before enable_language(CUDA)).
function(lcx_resolve_cuda_archs)
  if(DEFINED CMAKE_CUDA_ARCHITECTURES)
    message(STATUS "lcx: CUDA targets ${CMAKE_CUDA_ARCHITECTURES} (CMAKE_CUDA_ARCHITECTURES)")
    return()
  endif()
  set(archs "")
  if(LCX_CUDA_ARCHS STREQUAL "all")
    set(archs ${LCX_CUDA_ARCHS_ALL})
  elseif(LCX_CUDA_ARCHS STREQUAL "native")
    find_program(LCX_NVIDIA_SMI nvidia-smi)
    if(LCX_NVIDIA_SMI)
      execute_process(COMMAND ${LCX_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                      OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(rc EQUAL 0 AND caps)
        string(REPLACE "\n" ";" caps "${caps}")
        foreach(cap IN LISTS caps)
          string(STRIP "${cap}" cap)
          string(REPLACE "." "" cap "${cap}")
          if(NOT cap MATCHES "^[0-9]+$")
            continue()
          endif()
          if(cap LESS 80)
            message(WARNING "lcx: this machine's GPU is sm_${cap}; lcx needs sm_80 or newer (Ampere), so it builds "
                            "no code for it")
            continue()
          endif()
          # The Hopper kernels' own target serves the rest of a Hopper build too.
          if(cap EQUAL 90)
            set(cap 90a)
          endif()
          list(APPEND archs ${cap}-real)
        endforeach()
        list(REMOVE_DUPLICATES archs)
      endif()
    endif()
    if(NOT archs)
      set(archs ${LCX_CUDA_ARCHS_NO_GPU})
      message(STATUS "lcx: LCX_CUDA_ARCHS=native sees no GPU; building ${archs}")
    endif()
  else()
    set(archs ${LCX_CUDA_ARCHS})
    foreach(a IN LISTS archs)
      string(REGEX MATCH "^[0-9]+" number "${a}")
      if(NOT number OR number LESS 80)
        message(FATAL_ERROR "LCX_CUDA_ARCHS=${LCX_CUDA_ARCHS}: '${a}' is not a target lcx builds for; use all, native, "
                            "or CUDA_ARCHITECTURES entries of 80 or newer (e.g. 80-real;90a-real)")
      endif()
    endforeach()
  endif()
  set(CMAKE_CUDA_ARCHITECTURES ${archs} PARENT_SCOPE)
  message(STATUS "lcx: CUDA targets ${archs} (LCX_CUDA_ARCHS=${LCX_CUDA_ARCHS})")
endfunction()
