// Op registration of kilat's C++ kernels. Each kernel file is compiled once per instruction-set level
// (kilat/model_executor/native.py, ISAS) with -DKILAT_ISA=<level>, and registers its ops in the namespace
// <namespace>_<level> (e.g. kilat_quant_avx2), so that the builds of several levels load side by side in one process.
//   KILAT_LIBRARY(ns, m) { ... }  TORCH_LIBRARY for namespace ns_<level>
//   KILAT_OP_NAME(ns, op)         the string "ns_<level>::op", for the dispatcher's findSchema
#pragma once

#include <torch/library.h>

#ifndef KILAT_ISA
#error "compile with -DKILAT_ISA=<level> (kilat/model_executor/native.py builds these files)"
#endif

#define KILAT_CAT_(a, b) a##_##b
#define KILAT_CAT(a, b) KILAT_CAT_(a, b)
#define KILAT_STR_(a) #a
#define KILAT_STR(a) KILAT_STR_(a)
#define KILAT_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define KILAT_LIBRARY(ns, m) KILAT_LIBRARY_(KILAT_CAT(ns, KILAT_ISA), m)
#define KILAT_OP_NAME(ns, op) KILAT_STR(KILAT_CAT(ns, KILAT_ISA)) "::" #op
