// Everything of the engine layer in one include: tensors, ops, autograd, nn, optim, io.
//
//   #include "engine/engine.h"
//   using namespace quilt;
#pragma once

#include "engine/autograd.h"
#include "engine/checkpoint.h"
#include "engine/device.h"
#include "engine/io/safetensors.h"
#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/index.h"
#include "engine/ops/matmul.h"
#include "engine/ops/nn.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"
#include "engine/optim/adamw.h"
#include "engine/optim/clip_grad.h"
#include "engine/optim/lr_schedule.h"
#include "engine/optim/optimizer.h"
#include "engine/optim/sgd.h"
#include "engine/random.h"
#include "engine/tensor.h"
