# Fails when a file of core (core/src, core/include) names LoRA, a mixture of experts or experts
# ("lora", "moe", "expert", any case) and is not listed below with the reason it must: a family or
# a block feature lives in models/ and plugins/, so core learns of it only through the slots.
# Run as: cmake -DLCX_SOURCE_DIR=<repo> -P core_names_family.cmake
set(allowed
    # The op table: routing, permutation, combine and the grouped GEMM are ops, each a CPU
    # reference and a CUDA kernel behind one signature.
    core/include/lcx/ops.h core/src/kernels/ops.cpp core/src/kernels/cpu/cpu_ops.h
    core/src/kernels/cpu/moe_cpu.cpp core/src/kernels/cuda/cuda_ops.h core/src/kernels/cuda/moe.cu
    # PEFT's adapter format is LoRA's (lora_A, lora_B, lora_alpha, the Hub's per-expert keys), read
    # and written by core for `lcx-train merge`.
    core/include/lcx/peft.h core/src/io/peft_adapter.cpp core/src/app/merge_cmd.cpp
    # The rank mesh's expert-parallel axis ([distributed] ep): parsed, launched, laid out.
    core/include/lcx/mesh_shape.h core/src/distributed/mesh.cpp core/src/config/core_config.h
    core/src/config/core_config.cpp core/src/train/launch.cpp
    # Optimizer state files per expert-parallel rank.
    core/src/train/checkpoint.h core/src/train/checkpoint.cpp
    # The plan's inputs (the ep axis) and the grouped expert GEMMs priced at their own measured rate.
    core/include/lcx/plan.h core/include/lcx/rates.h core/src/plan/rates.h core/src/plan/rates.cpp
    # calibrate measures that rate at a mixture-of-experts layer's shapes.
    core/src/app/calibrate_cmd.cpp
    # The Adapter slot: per-expert factors of a module of stacked experts (find_experts).
    core/include/lcx/slots/adapter.h
    # The Model slot: a linear module's stacked experts (the adapter and the plan size them).
    core/include/lcx/slots/model.h)
file(GLOB_RECURSE files RELATIVE ${LCX_SOURCE_DIR} ${LCX_SOURCE_DIR}/core/src/* ${LCX_SOURCE_DIR}/core/include/*
     ${LCX_SOURCE_DIR}/core/CMakeLists.txt)
set(found 0)
foreach(file ${files})
  list(FIND allowed ${file} listed)
  if(NOT listed EQUAL -1)
    continue()
  endif()
  file(READ ${LCX_SOURCE_DIR}/${file} text)
  string(TOLOWER "${text}" text)
  foreach(word lora moe expert)
    string(FIND "${text}" "${word}" at)
    if(NOT at EQUAL -1)
      message(SEND_ERROR "${file} names '${word}': a family's or block's concept belongs in models/ or plugins/; "
                         "reach it through a slot, or list the file here with why core must name it")
      math(EXPR found "${found} + 1")
      break()
    endif()
  endforeach()
endforeach()
foreach(file ${allowed})
  if(NOT EXISTS ${LCX_SOURCE_DIR}/${file})
    message(SEND_ERROR "${file} is listed but does not exist: remove it from the list")
  endif()
endforeach()
if(found EQUAL 0)
  message(STATUS "no unlisted core file names lora, moe or expert")
endif()
