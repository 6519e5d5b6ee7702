// Reads a TensorBoard events file (logging.tensorboard) back: every TFRecord's two masked
// CRC32Cs (of the length and of the data) must match, the first Event must carry
// file_version "brain.Event:2", and every step of the run's metrics.jsonl must have an Event
// whose summary holds each tag with the metrics file's value (as a float).
//
//   tfevents_check events.out.tfevents.* metrics.jsonl loss lr grad_norm tps memory_gib
//
// The CRC here is computed bit by bit, not with the writer's table, and the protobuf decoding is
// a reader of its own, so the check does not share the code it checks.
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace {

uint32_t crc32c_bitwise(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

uint32_t masked(const uint8_t* p, size_t n) {
  const uint32_t c = crc32c_bitwise(p, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Reader {
  const uint8_t* p;
  const uint8_t* end;
  bool ok = true;
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; p < end && shift < 64; shift += 7) {
      const uint8_t b = *p++;
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    ok = false;
    return 0;
  }
  std::string bytes() {
    const uint64_t n = varint();
    if (uint64_t(end - p) < n) {
      ok = false;
      return {};
    }
    std::string s(reinterpret_cast<const char*>(p), size_t(n));
    p += n;
    return s;
  }
  void skip(int wire) {
    if (wire == 0) varint();
    else if (wire == 1) p += 8;
    else if (wire == 2) bytes();
    else if (wire == 5) p += 4;
    else ok = false;
    if (p > end) ok = false;
  }
};

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::map<std::string, float> values;
};

bool decode(const std::string& data, Event& e) {
  Reader r{reinterpret_cast<const uint8_t*>(data.data()), reinterpret_cast<const uint8_t*>(data.data()) + data.size()};
  while (r.ok && r.p < r.end) {
    const uint64_t key = r.varint();
    const int field = int(key >> 3), wire = int(key & 7);
    if (field == 1 && wire == 1 && r.end - r.p >= 8) {
      e.wall_time = load<double>(r.p);
      r.p += 8;
    } else if (field == 2 && wire == 0) {
      e.step = int64_t(r.varint());
    } else if (field == 3 && wire == 2) {
      e.file_version = r.bytes();
    } else if (field == 5 && wire == 2) {
      const std::string summary = r.bytes();
      Reader s{reinterpret_cast<const uint8_t*>(summary.data()),
               reinterpret_cast<const uint8_t*>(summary.data()) + summary.size()};
      while (s.ok && s.p < s.end) {
        const uint64_t k = s.varint();
        if ((k >> 3) != 1 || (k & 7) != 2) {
          s.skip(int(k & 7));
          continue;
        }
        const std::string value = s.bytes();
        Reader v{reinterpret_cast<const uint8_t*>(value.data()),
                 reinterpret_cast<const uint8_t*>(value.data()) + value.size()};
        std::string tag;
        float simple = NAN;
        while (v.ok && v.p < v.end) {
          const uint64_t vk = v.varint();
          if ((vk >> 3) == 1 && (vk & 7) == 2) tag = v.bytes();
          else if ((vk >> 3) == 2 && (vk & 7) == 5 && v.end - v.p >= 4) {
            simple = load<float>(v.p);
            v.p += 4;
          } else v.skip(int(vk & 7));
        }
        if (!v.ok) return false;
        e.values[tag] = simple;
      }
      if (!s.ok) return false;
    } else {
      r.skip(wire);
    }
  }
  return r.ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: tfevents_check EVENTS_FILE METRICS.jsonl TAG...\n");
    return 2;
  }
  std::ifstream f(argv[1], std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", argv[1]);
    return 1;
  }
  const std::string file((std::istreambuf_iterator<char>(f)), {});
  const auto* base = reinterpret_cast<const uint8_t*>(file.data());
  std::vector<Event> events;
  size_t at = 0;
  while (at < file.size()) {
    if (file.size() - at < 12) {
      std::fprintf(stderr, "%s: %zu stray bytes at offset %zu\n", argv[1], file.size() - at, at);
      return 1;
    }
    const uint64_t len = load<uint64_t>(base + at);
    if (load<uint32_t>(base + at + 8) != masked(base + at, 8)) {
      std::fprintf(stderr, "%s: record %zu at offset %zu: the length CRC does not match\n", argv[1], events.size(), at);
      return 1;
    }
    if (file.size() - at - 12 < len + 4) {
      std::fprintf(stderr, "%s: record %zu at offset %zu is cut short\n", argv[1], events.size(), at);
      return 1;
    }
    const uint8_t* data = base + at + 12;
    if (load<uint32_t>(data + len) != masked(data, size_t(len))) {
      std::fprintf(stderr, "%s: record %zu at offset %zu: the data CRC does not match\n", argv[1], events.size(), at);
      return 1;
    }
    Event e;
    if (!decode(std::string(reinterpret_cast<const char*>(data), size_t(len)), e)) {
      std::fprintf(stderr, "%s: record %zu is not a valid Event proto\n", argv[1], events.size());
      return 1;
    }
    events.push_back(e);
    at += 12 + len + 4;
  }
  int bad = 0;
  if (events.empty() || events[0].file_version != "brain.Event:2") {
    std::fprintf(stderr, "the first record has no file_version brain.Event:2\n");
    ++bad;
  }
  std::map<int64_t, const Event*> by_step;
  for (size_t i = 1; i < events.size(); ++i) {
    by_step[events[i].step] = &events[i];
    if (events[i].wall_time < 1.6e9) {
      std::fprintf(stderr, "event %zu: wall_time %.0f is not a current Unix time\n", i, events[i].wall_time);
      ++bad;
    }
  }
  std::ifstream m(argv[2]);
  std::string line;
  int steps = 0;
  while (std::getline(m, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    const int64_t step = j.at("step").get<int64_t>();
    ++steps;
    auto it = by_step.find(step);
    if (it == by_step.end()) {
      std::fprintf(stderr, "no event for step %lld\n", static_cast<long long>(step));
      ++bad;
      continue;
    }
    for (int t = 3; t < argc; ++t) {
      const auto v = it->second->values.find(argv[t]);
      if (v == it->second->values.end()) {
        std::fprintf(stderr, "step %lld: no value tagged '%s'\n", static_cast<long long>(step), argv[t]);
        ++bad;
      } else if (v->second != float(j.at(argv[t]).get<double>())) {
        std::fprintf(stderr, "step %lld: %s is %g in the events file, %g in %s\n", static_cast<long long>(step),
                     argv[t], double(v->second), j.at(argv[t]).get<double>(), argv[2]);
        ++bad;
      }
    }
  }
  if (steps == 0) {
    std::fprintf(stderr, "%s has no steps\n", argv[2]);
    ++bad;
  }
  std::printf("tfevents_check: %s: %zu records, CRCs match, %d steps with %d tags each%s\n", argv[1], events.size(),
              steps, argc - 3, bad ? ": FAILED" : "");
  return bad ? 1 : 0;
}
