// Where a tensor lives: the CPU or one CUDA device. Streams and events are per device;
// on the CPU they are trivial so code that overlaps work is written once for both.
//
//   Device d = Device::cuda(1);  d.str() == "cuda:1"
#pragma once

#include <cstdint>
#include <string>

namespace quilt {

enum class DeviceType : uint8_t { CPU, CUDA };

/// A device: the CPU, or CUDA device `index`.
struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::CPU, 0}; }
  static constexpr Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  constexpr bool is_cpu() const { return type == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type == DeviceType::CUDA; }
  /// "cpu" or "cuda:N".
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
  /// Parses "cpu", "cuda", "cuda:N"; throws naming the text otherwise.
  static Device parse(const std::string& s);
  friend constexpr bool operator==(const Device&, const Device&) = default;
};

/// An ordered queue of work on a device. On the CPU there is one stream and work is synchronous.
struct Stream {
  Device device;
  void* handle = nullptr;  // cudaStream_t on CUDA; nullptr = the default stream
  friend bool operator==(const Stream&, const Stream&) = default;
};

/// A marker in a stream that another stream (or the host) can wait for.
class Event {
 public:
  explicit Event(Device device = Device::cpu());
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  /// Marks the current end of `s`.
  void record(const Stream& s);
  /// Makes `s` wait until the recorded point is reached (no host blocking).
  void wait(const Stream& s) const;
  /// Blocks the host until the recorded point is reached.
  void synchronize() const;
  /// True once the recorded work has completed.
  bool query() const;

 private:
  Device device_;
  void* handle_ = nullptr;  // cudaEvent_t on CUDA
};

/// The stream that ops on `d` enqueue to (per host thread).
Stream current_stream(Device d);
/// Replaces the current stream for the device of `s` on this thread.
void set_current_stream(const Stream& s);
/// A new non-default stream on `d` (the CPU has only one stream).
Stream new_stream(Device d);
/// Blocks until all work queued on `s` is done; then throws, naming the op, any bad input a
/// kernel on that device reported since the last synchronisation (an index out of range).
void synchronize(const Stream& s);

/// RAII: makes `s` current on this thread for its device, restores the previous one after.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& s) : prev_(current_stream(s.device)) { set_current_stream(s); }
  ~StreamGuard() { set_current_stream(prev_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream prev_;
};

namespace cuda {
/// True when this build has CUDA and a usable device is present.
bool is_available();
/// Number of CUDA devices (0 when unavailable).
int device_count();
/// Why CUDA is not available ("built without CUDA", the driver's message, ...), empty if it is.
std::string unavailable_reason();
/// Makes device `i` current on this thread.
void set_device(int i);
/// Device `i`'s PCI bus id ("0000:41:00.0"): the same physical GPU has the same id in every
/// process on a host, whatever CUDA_VISIBLE_DEVICES renumbered.
std::string pci_bus_id(int i);
/// Device `i`'s UUID (32 hex digits): unique to one physical GPU (or MIG instance) anywhere.
std::string uuid(int i);
/// True while a graph capture runs anywhere in this process: the watchdog then polls no event
/// (querying one is illegal during a capture) and lets no deadline fire.
bool capture_underway();

/// A CUDA graph: the work one stream queues between capture_begin() and capture_end(), replayed
/// as one launch. Memory allocated on that stream during the capture comes from a private pool
/// of the caching allocator that the graph keeps until reset() (replays write those addresses);
/// `share_pool_with` captures into another graph's pool.
///
///   Graph g;  g.capture_begin(s);  step();  g.capture_end();   // s: a non-default stream
///   for (...) g.replay(s);
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  /// Starts capturing the work queued on `s` (a non-default CUDA stream), which becomes the
  /// current stream of its device on this thread until capture_end().
  void capture_begin(const Stream& s, const Graph* share_pool_with = nullptr);
  /// Ends the capture and instantiates the graph.
  void capture_end();
  /// Launches the captured work on `s`.
  void replay(const Stream& s);
  /// Drops the graph; its private memory goes back to the allocator after the last replay.
  void reset();
  bool captured() const { return exec_ != nullptr; }

 private:
  Stream stream_;       // the capture stream
  Stream prev_;         // the stream current before capture_begin, restored at capture_end
  Stream last_replay_;  // where the last replay ran
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
  int pool_ = 0;           // the allocator's private pool
  bool capturing_ = false;
};
}  // namespace cuda

namespace detail {
/// Counts captures for cuda::capture_underway() (+1 at a capture's begin, -1 at its end).
void note_capture(int delta);
}  // namespace detail

}  // namespace quilt
