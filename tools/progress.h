// Progress of long work on stderr: on a terminal one line rewritten in place (carriage
// returns, about 5 times a second); otherwise (a log file, CI) a plain line every
// QUILT_PROGRESS_EVERY_S seconds (default 10), and always a last line when done.
//
//   ProgressLine p("data prepare");
//   p.update(bytes, total, "1,234 documents, 56,789 tokens/s");   // throttled
//   p.finish("done");
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace quilt {

/// A throttled progress line with bytes done of a total, rate and ETA.
class ProgressLine {
 public:
  /// `what` starts every line; `terminal` < 0 asks isatty(stderr).
  explicit ProgressLine(std::string what, int terminal = -1);
  /// Shows `done` of `total` bytes with `detail`, when the last line is old enough.
  void update(int64_t done, int64_t total, const std::string& detail);
  /// Shows the final line (always) and ends the in-place line.
  void finish(int64_t done, int64_t total, const std::string& detail);
  /// Seconds since construction.
  double elapsed() const;

 private:
  void show(int64_t done, int64_t total, const std::string& detail, bool last);
  std::string what_;
  bool terminal_;
  double every_s_;
  std::chrono::steady_clock::time_point start_, last_;
  bool shown_ = false;
};

}  // namespace quilt
