// Test hooks (test_hooks.cc): bindings of the core's pure logic for one-process unit tests.
#pragma once

#include <pybind11/pybind11.h>

namespace hvdlite {

void DefineTestHooks(pybind11::module_& m);
// test_hooks_hypercube.cc: the control plane's hypercube over in-memory mailboxes.
void DefineHypercubeHooks(pybind11::module_& m);

}  // namespace hvdlite
