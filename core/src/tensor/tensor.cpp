#include "lcx/tensor.h"

#include <cstring>
#include <map>
#include <mutex>

#include "lcx/profile.h"
#include "lcx/size_math.h"

namespace lcx {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Storage::Storage(Device d, size_t bytes, MemoryCategory c) : bytes_(bytes), device_(d), category_(c) {
  data_ = allocator_for(d).allocate(bytes, c);
}

Storage::~Storage() { allocator_for(device_).deallocate(data_, bytes_, category_); }

Tensor Tensor::empty(Shape shape, DType dtype, Device device, MemoryCategory category) {
  int64_t n = 1;
  for (int64_t d : shape) {
    LCX_CHECK(d >= 0, "negative dimension in ", shape_str(shape));
    n = checked_mul(n, d, str("tensor ", shape_str(shape)));
  }
  checked_mul(n, static_cast<int64_t>(dtype_size(dtype)), str("tensor ", shape_str(shape), " of ", dtype_name(dtype)));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>(device, t.nbytes(), category);
  t.data_ = t.storage_->data();
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device, MemoryCategory category) {
  Tensor t = empty(std::move(shape), dtype, device, category);
  t.zero();
  return t;
}

Tensor Tensor::borrow(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.data_ = data;
  return t;
}

int64_t Tensor::size(int64_t axis) const {
  int64_t n = dim();
  if (axis < 0) axis += n;
  LCX_CHECK(axis >= 0 && axis < n, "axis ", axis, " out of range for shape ", shape_str(shape_));
  return shape_[static_cast<size_t>(axis)];
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  LCX_CHECK(dim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "rows [", begin, ", ", end,
            ") of ", shape_str(shape_));
  Tensor t = *this;
  int64_t row = numel() / std::max<int64_t>(shape_[0], 1);
  t.shape_[0] = end - begin;
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::view(Shape shape) const {
  LCX_CHECK(shape_numel(shape) == numel(), "view ", shape_str(shape), " of ", shape_str(shape_));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

static void host_convert(const void* src, DType st, void* dst, DType dt, int64_t n) {
  auto load = [&](int64_t i) -> double {
    switch (st) {
      case DType::bf16: return bf16_to_float(static_cast<const bf16*>(src)[i]);
      case DType::f16: return f16_to_float(static_cast<const f16*>(src)[i]);
      case DType::f32: return static_cast<const float*>(src)[i];
      case DType::i32: return static_cast<const int32_t*>(src)[i];
      case DType::i64: return static_cast<double>(static_cast<const int64_t*>(src)[i]);
    }
    return 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    double v = load(i);
    switch (dt) {
      case DType::bf16: static_cast<bf16*>(dst)[i] = float_to_bf16(static_cast<float>(v)); break;
      case DType::f16: static_cast<f16*>(dst)[i] = float_to_f16(static_cast<float>(v)); break;
      case DType::f32: static_cast<float*>(dst)[i] = static_cast<float>(v); break;
      case DType::i32: static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v); break;
      case DType::i64: static_cast<int64_t*>(dst)[i] = static_cast<int64_t>(v); break;
    }
  }
}

Tensor Tensor::to(Device device) const {
  MemoryCategory c = storage_ ? storage_->category() : MemoryCategory::transient;
  Tensor t = empty(shape_, dtype_, device, c);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  Tensor host = device_.is_cuda() ? to(Device::cpu()) : *this;
  Tensor out = empty(shape_, dtype, Device::cpu());
  host_convert(host.data(), dtype_, out.data(), dtype, numel());
  return device_.is_cuda() ? out.to(device_) : out;
}

Tensor Tensor::clone() const { return to(device_); }

void Tensor::copy_from(const Tensor& src) {
  LCX_CHECK(src.dtype_ == dtype_ && src.numel() == numel(), "copy ", dtype_name(src.dtype_),
            shape_str(src.shape_), " into ", dtype_name(dtype_), shape_str(shape_));
  if (nbytes() == 0) return;
  ProfileScope scope(OpKind::copy, copy_name(device_.is_cuda(), src.device_.is_cuda()));
  if (!device_.is_cuda() && !src.device_.is_cuda()) {
    std::memmove(data_, src.data_, nbytes());
    return;
  }
  DeviceBackend* b = backend_for(device_.is_cuda() ? device_ : src.device_);
  LCX_CHECK(b != nullptr, "no CUDA backend in this build");
  b->copy(data_, device_, src.data_, src.device_, nbytes());
}

void Tensor::zero() {
  if (nbytes() == 0) return;
  ProfileScope scope(OpKind::other, "zero");
  if (!device_.is_cuda()) {
    std::memset(data_, 0, nbytes());
    return;
  }
  DeviceBackend* b = backend_for(device_);
  LCX_CHECK(b != nullptr, "no CUDA backend in this build");
  b->fill_zero(data_, nbytes());
}

std::vector<float> Tensor::to_floats() const {
  Tensor host = device_.is_cuda() ? to(Device::cpu()) : *this;
  std::vector<float> out(static_cast<size_t>(numel()));
  host_convert(host.data(), dtype_, out.data(), DType::f32, numel());
  return out;
}

Tensor Tensor::from_floats(const std::vector<float>& v, Shape shape, DType dtype, Device device) {
  LCX_CHECK(shape_numel(shape) == static_cast<int64_t>(v.size()), "from_floats: ", v.size(),
            " values for shape ", shape_str(shape));
  Tensor host = empty(shape, dtype, Device::cpu());
  host_convert(v.data(), DType::f32, host.data(), dtype, host.numel());
  return device.is_cuda() ? host.to(device) : host;
}

namespace {
struct Backends {
  std::mutex mu;
  std::map<DeviceType, std::shared_ptr<DeviceBackend>> map;
};
Backends& backends() {
  static Backends b;
  return b;
}
}  // namespace

DeviceBackend* backend_for(Device d) {
  auto& b = backends();
  std::lock_guard lock(b.mu);
  auto it = b.map.find(d.type);
  return it == b.map.end() ? nullptr : it->second.get();
}

void install_backend(DeviceType t, std::shared_ptr<DeviceBackend> backend) {
  auto& b = backends();
  std::lock_guard lock(b.mu);
  b.map[t] = std::move(backend);
}

}  // namespace lcx
