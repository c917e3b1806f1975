// A typed, shaped, contiguous view of device or host memory. Storage is shared and returns to its
// allocator when the last view goes; views along the first dimension (rows) share it, which is
// all the step needs: chunks of tokens, layers of a stacked buffer.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "lcx/dtype.h"
#include "lcx/error.h"
#include "lcx/memory.h"

namespace lcx {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Storage {
 public:
  Storage(Device d, size_t bytes, MemoryCategory c);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  MemoryCategory category() const { return category_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
  MemoryCategory category_;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, Device device = Device::cpu(),
                      MemoryCategory category = MemoryCategory::transient);
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu(),
                      MemoryCategory category = MemoryCategory::transient);
  // Wraps memory the caller owns (mapped files, pinned pools); the caller keeps it alive.
  static Tensor borrow(void* data, Shape shape, DType dtype, Device device);

  bool defined() const { return storage_ != nullptr || data_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t axis) const;  // negative axes count from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }

  // Rows [begin, end) of the first dimension, sharing storage.
  Tensor rows(int64_t begin, int64_t end) const;
  // Same bytes, another shape with the same element count.
  Tensor view(Shape shape) const;
  // A new tensor on `device` (and `dtype`, converting on the host when it differs).
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  Tensor clone() const;
  // Byte copy from a tensor of the same dtype and element count, across devices if needed.
  void copy_from(const Tensor& src);
  void zero();
  // fp32 values on the host, whatever the dtype and device: for tests, checks and logs.
  std::vector<float> to_floats() const;
  static Tensor from_floats(const std::vector<float>& v, Shape shape, DType dtype,
                            Device device = Device::cpu());

 private:
  std::shared_ptr<Storage> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::f32;
  Device device_;
};

// Copies between host and device memory go through the backend that owns the device; the CUDA
// backend installs one when present. Core calls this; plugins use Tensor::copy_from.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void synchronize() = 0;
};
DeviceBackend* backend_for(Device d);  // nullptr when the device has no backend in this build
void install_backend(DeviceType t, std::shared_ptr<DeviceBackend> b);
bool cuda_available();  // a CUDA build with at least one visible GPU
int cuda_device_count();  // visible GPUs; 0 in a build without CUDA

}  // namespace lcx
