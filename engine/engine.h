// Everything of the engine layer in one include: tensors, ops, autograd, nn, optim, io.
//
//   #include "engine/engine.h"
//   using namespace quilt;
#pragma once

#include "engine/autograd.h"
#include "engine/device.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/index.h"
#include "engine/ops/matmul.h"
#include "engine/ops/nn.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"
#include "engine/random.h"
#include "engine/tensor.h"
