// Device parsing, per-thread current streams, events (trivial on the CPU).
#include "engine/device.h"

#include <atomic>
#include <map>

#include "engine/cuda_runtime.h"
#include "engine/error.h"

namespace quilt {

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    const std::string n = s.substr(5);
    QUILT_CHECK(!n.empty() && n.find_first_not_of("0123456789") == std::string::npos,
                "[device] cannot parse device '", s, "': expected cpu, cuda or cuda:N");
    return cuda(std::stoi(n));
  }
  fail("[device] cannot parse device '", s, "': expected cpu, cuda or cuda:N");
}

namespace {
thread_local std::map<int, Stream> t_cuda_streams;
}

Stream current_stream(Device d) {
  if (d.is_cpu()) return Stream{d, nullptr};
  auto it = t_cuda_streams.find(d.index);
  return it == t_cuda_streams.end() ? Stream{d, nullptr} : it->second;
}

void set_current_stream(const Stream& s) {
  if (s.device.is_cuda()) t_cuda_streams[s.device.index] = s;
}

Stream new_stream(Device d) {
  if (d.is_cpu()) return Stream{d, nullptr};
  return Stream{d, detail::cuda_stream_create(d.index)};
}

void synchronize(const Stream& s) {
  if (!s.device.is_cuda()) return;
  detail::cuda_stream_synchronize(s.handle);
  // Bad input the device's kernels met (they never stop on it) surfaces here, named.
  detail::cuda_check_device_errors(s.device.index);
}

Event::Event(Device device) : device_(device) {
  if (device_.is_cuda()) handle_ = detail::cuda_event_create(device_.index);
}
Event::~Event() {
  if (handle_) detail::cuda_event_destroy(handle_);
}
void Event::record(const Stream& s) {
  QUILT_CHECK(s.device == device_, "[event] recorded on ", s.device.str(), " but created for ", device_.str());
  if (handle_) detail::cuda_event_record(handle_, s.handle);
}
void Event::wait(const Stream& s) const {
  if (handle_ && s.device.is_cuda()) detail::cuda_event_wait(handle_, s.handle);
  if (handle_ && s.device.is_cpu()) detail::cuda_event_synchronize(handle_);
}
void Event::synchronize() const {
  if (handle_) detail::cuda_event_synchronize(handle_);
}
bool Event::query() const { return handle_ ? detail::cuda_event_query(handle_) : true; }

namespace {
std::atomic<int> g_captures{0};
}
bool cuda::capture_underway() { return g_captures.load(std::memory_order_acquire) > 0; }
void detail::note_capture(int delta) { g_captures.fetch_add(delta, std::memory_order_acq_rel); }

}  // namespace quilt
