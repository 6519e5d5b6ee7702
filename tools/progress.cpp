// Progress lines: see progress.h.
#include "tools/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "tools/metrics.h"

namespace quilt {
namespace {

std::string size_text(int64_t b) {
  char buf[32];
  if (b >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(int64_t(1) << 30));
  else std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  return buf;
}

}  // namespace

ProgressLine::ProgressLine(std::string what, int terminal)
    : what_(std::move(what)), terminal_(terminal < 0 ? isatty(STDERR_FILENO) == 1 : terminal > 0),
      every_s_(terminal_ ? 0.2 : 10.0), start_(std::chrono::steady_clock::now()), last_(start_) {
  if (const char* v = std::getenv("QUILT_PROGRESS_EVERY_S"); v && *v && !terminal_) every_s_ = std::atof(v);
}

double ProgressLine::elapsed() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void ProgressLine::update(int64_t done, int64_t total, const std::string& detail) {
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_).count() < every_s_) return;
  last_ = now;
  show(done, total, detail, false);
}

void ProgressLine::finish(int64_t done, int64_t total, const std::string& detail) { show(done, total, detail, true); }

void ProgressLine::show(int64_t done, int64_t total, const std::string& detail, bool last) {
  const double secs = elapsed();
  char head[160];
  const double pct = total > 0 ? 100.0 * double(done) / double(total) : 100.0;
  std::snprintf(head, sizeof head, "%s: %s of %s (%.1f%%)", what_.c_str(), size_text(done).c_str(),
                size_text(total).c_str(), pct);
  std::string line = head;
  if (!detail.empty()) line += ", " + detail;
  if (last) line += ", took " + short_duration(secs);
  else if (done > 0 && secs > 0) line += ", eta " + short_duration(secs / double(done) * double(total - done));
  if (terminal_) {
    // Padding clears what a longer previous line left.
    std::fprintf(stderr, "\r%-100s%s", line.c_str(), last ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
  shown_ = true;
}

}  // namespace quilt
