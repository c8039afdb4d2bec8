// The one extension module of all the kernel sources (compiled together: setup.py at install,
// or loader.py at run time). Each source binds its own functions in a bind_<file> declared
// in kernels.h; this file calls them and says what the build was made from.
#include "kernels.h"

// What this build was made from (build_key.py passes them as -D hex tokens; loader.py reuses
// a build only while they match its sources, torch, -march and CPU).
#define FORERUN_STR_(x) #x
#define FORERUN_STR(x) FORERUN_STR_(x)
#ifndef FORERUN_BUILD_KEY
#define FORERUN_BUILD_KEY none
#define FORERUN_BUILD_SOURCES none
#define FORERUN_BUILD_CPU none
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_int8_rows(m);
  bind_layer_rows(m);
  bind_gguf_rows(m);
  bind_gguf_packed_rows(m);
  bind_int4_fit_rows(m);
  m.attr("BUILD_KEY") = FORERUN_STR(FORERUN_BUILD_KEY);
  m.attr("BUILD_SOURCES") = FORERUN_STR(FORERUN_BUILD_SOURCES);
  m.attr("BUILD_CPU") = FORERUN_STR(FORERUN_BUILD_CPU);
}
