# lcx_add_plugin(NAME name SOURCES ... [CUDA_SOURCES ...] [LIBS ...])
# Builds lcx_<name>.so into the plugin folder, against the SDK only (lcx::sdk).
function(lcx_add_plugin)
  cmake_parse_arguments(P "" "NAME;OUTPUT_DIR" "SOURCES;CUDA_SOURCES;LIBS" ${ARGN})
  set(target lcx_${P_NAME})
  set(srcs ${P_SOURCES})
  if(LCX_HAVE_CUDA)
    list(APPEND srcs ${P_CUDA_SOURCES})
  endif()
  add_library(${target} MODULE ${srcs})
  set_target_properties(${target} PROPERTIES PREFIX "" OUTPUT_NAME ${target}
                        LIBRARY_OUTPUT_DIRECTORY ${LCX_PLUGIN_OUTPUT_DIR}
                        INSTALL_RPATH "$ORIGIN/../.." BUILD_WITH_INSTALL_RPATH ON)
  if(P_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${P_OUTPUT_DIR})
  endif()
  target_link_libraries(${target} PRIVATE lcx::sdk ${P_LIBS})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${LCX_WARNINGS}>)
  # The loader refuses a plugin writable by group or others (README: Plugin trust), whatever the umask.
  add_custom_command(TARGET ${target} POST_BUILD
                     COMMAND chmod go-w $<TARGET_FILE:${target}> $<TARGET_FILE_DIR:${target}>)
endfunction()
