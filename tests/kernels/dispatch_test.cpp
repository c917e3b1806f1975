// The op dispatch: arguments on different devices, device tensors in a CPU-only build, and the
// messages that name the op, the argument and the shapes.
#include "kernels/kernel_test_util.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::error_of;

TEST(OpsDispatch, MixedDevicesAreRefusedBeforeAnyWork) {
  // A borrowed "device" tensor over host memory: the dispatch must refuse it without reading it.
  std::vector<float> host(8);
  Tensor a = Tensor::empty({8}, DType::f32);
  Tensor d = Tensor::borrow(host.data(), {8}, DType::f32, Device::cuda(0));
  const std::string m = error_of([&] { ops::add_inplace(a, d); });
  EXPECT_NE(m.find("add_inplace"), std::string::npos) << m;
  EXPECT_NE(m.find("cuda"), std::string::npos) << m;
}

#ifndef LCX_HAVE_CUDA
TEST(OpsDispatch, DeviceTensorsNeedACudaBuild) {
  std::vector<float> host(8);
  Tensor d = Tensor::borrow(host.data(), {8}, DType::f32, Device::cuda(0));
  const std::string m = error_of([&] { ops::scale_inplace(d, 2.f); });
  EXPECT_NE(m.find("no CUDA backend"), std::string::npos) << m;
}
#endif

TEST(OpsDispatch, ShapeErrorsNameOpArgumentAndShapes) {
  Tensor g = Tensor::zeros({2, 3}, DType::f32), u = Tensor::zeros({3, 2}, DType::f32);
  Tensor out = Tensor::zeros({2, 3}, DType::f32);
  const std::string m = error_of([&] { ops::swiglu_forward(g, u, out); });
  EXPECT_NE(m.find("swiglu_forward"), std::string::npos) << m;
  EXPECT_NE(m.find("up fp32[3, 2]"), std::string::npos) << m;
  EXPECT_NE(m.find("gate fp32[2, 3]"), std::string::npos) << m;
}

TEST(OpsDispatch, IntegerTensorsAreNotFloats) {
  Tensor i = Tensor::zeros({4}, DType::i32), f = Tensor::zeros({4}, DType::f32);
  const std::string m = error_of([&] { ops::cast(i, f); });
  EXPECT_NE(m.find("cast: src int32[4]"), std::string::npos) << m;
}

TEST(OpsDispatch, UndefinedTensorIsNamed) {
  Tensor a = Tensor::zeros({4}, DType::f32), none;
  const std::string m = error_of([&] { ops::add(a, none, a); });
  EXPECT_NE(m.find("add: argument b is an undefined tensor"), std::string::npos) << m;
}

}  // namespace
}  // namespace lcx
