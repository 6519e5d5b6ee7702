// DeviceMesh: per-axis communicators by split, sub-meshes and flattened axes (cached).
#include "dtensor/mesh.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "dtensor/dispatch.h"

namespace quilt {
namespace detail {

struct MeshState {
  std::shared_ptr<Communicator> comm;  // over exactly the mesh's ranks, in mesh order
  const Communicator* root = nullptr;  // the communicator of the outermost mesh (identity)
  std::shared_ptr<Communicator> root_comm;  // that communicator
  Shape shape;
  std::vector<std::string> names;
  Shape coord;
  std::vector<int> ranks;  // root ranks of every position, row-major
  std::vector<std::shared_ptr<Communicator>> axis_comms;
  std::mutex mu;
  std::map<std::string, std::shared_ptr<MeshState>> children;  // sub-meshes by key, built once
};

}  // namespace detail

namespace {

using detail::MeshState;

int64_t ravel(const Shape& coord, const Shape& shape) {
  int64_t r = 0;
  for (size_t i = 0; i < shape.size(); ++i) r = r * shape[i] + coord[i];
  return r;
}

Shape unravel(int64_t r, const Shape& shape) {
  Shape c(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    c[i] = r % shape[i];
    r /= shape[i];
  }
  return c;
}

std::string join(const std::vector<std::string>& names, const char* sep) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? sep : "") + names[i];
  return s;
}

void check_names(const std::vector<std::string>& names, size_t ndim) {
  QUILT_CHECK(names.size() == ndim, "[device_mesh] ", ndim, " axes but ", names.size(), " axis names (",
              join(names, ", "), ")");
  for (size_t i = 0; i < names.size(); ++i) {
    QUILT_CHECK(!names[i].empty(), "[device_mesh] axis ", i, " has an empty name");
    for (size_t j = 0; j < i; ++j)
      QUILT_CHECK(names[i] != names[j], "[device_mesh] axis name '", names[i], "' is used twice");
  }
}

// Root ranks of the positions whose coordinates agree with `coord` outside `axes`, ordered
// row-major over `axes` (in the order given).
std::vector<int> ranks_along(const MeshState& s, const std::vector<int64_t>& axes) {
  Shape sub_shape;
  for (int64_t a : axes) sub_shape.push_back(s.shape[size_t(a)]);
  const int64_t n = numel_of(sub_shape);
  std::vector<int> out;
  out.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    Shape c = s.coord;
    const Shape sc = unravel(i, sub_shape);
    for (size_t k = 0; k < axes.size(); ++k) c[size_t(axes[k])] = sc[k];
    out.push_back(s.ranks[size_t(ravel(c, s.shape))]);
  }
  return out;
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<Communicator> comm, Shape shape, std::vector<std::string> axis_names) {
  QUILT_CHECK(comm != nullptr, "[device_mesh] got a null communicator");
  QUILT_CHECK(!shape.empty(), "[device_mesh] a mesh needs at least one axis");
  check_names(axis_names, shape.size());
  for (size_t i = 0; i < shape.size(); ++i)
    QUILT_CHECK(shape[i] >= 1, "[device_mesh] axis '", axis_names[i], "' has size ", shape[i], " (must be >= 1)");
  QUILT_CHECK(numel_of(shape) == comm->size(), "[device_mesh] mesh shape ", shape, " (", numel_of(shape),
              " ranks) does not match the ", comm->size(), " ranks of communicator ", comm->name());
  detail::ensure_dtensor_dispatch();
  auto s = std::make_shared<MeshState>();
  s->comm = comm;
  s->root = comm.get();
  s->root_comm = comm;
  s->shape = shape;
  s->names = std::move(axis_names);
  s->coord = unravel(comm->rank(), shape);
  s->ranks.resize(size_t(comm->size()));
  for (int r = 0; r < comm->size(); ++r) s->ranks[size_t(r)] = r;
  if (shape.size() == 1) {
    s->axis_comms = {comm};
  } else {
    // One split per axis, in axis order on every rank: color = the position with this axis
    // removed, key = the coordinate along it.
    for (size_t a = 0; a < shape.size(); ++a) {
      Shape rest_shape, rest_coord;
      for (size_t b = 0; b < shape.size(); ++b)
        if (b != a) { rest_shape.push_back(shape[b]); rest_coord.push_back(s->coord[b]); }
      const int color = int(ravel(rest_coord, rest_shape));
      s->axis_comms.push_back(comm->split(color, int(s->coord[a])));
    }
  }
  // Traces name each collective's mesh axis (the first mesh to use a communicator labels it).
  for (size_t a = 0; a < shape.size(); ++a)
    if (a < s->names.size() && s->axis_comms[a]->axis().empty()) s->axis_comms[a]->set_axis(s->names[a]);
  state_ = std::move(s);
}

DeviceMesh DeviceMesh::one_d(std::shared_ptr<Communicator> comm, const std::string& axis_name) {
  QUILT_CHECK(comm != nullptr, "[device_mesh] got a null communicator");
  const int64_t n = comm->size();
  return DeviceMesh(std::move(comm), {n}, {axis_name});
}

const detail::MeshState& DeviceMesh::state() const {
  QUILT_CHECK(state_ != nullptr, "[device_mesh] use of an undefined mesh");
  return *state_;
}

int64_t DeviceMesh::ndim() const { return int64_t(state().shape.size()); }
const Shape& DeviceMesh::shape() const { return state().shape; }
int64_t DeviceMesh::size(int64_t axis) const {
  return state().shape[size_t(wrap_dim(axis, ndim(), "device_mesh"))];
}
int64_t DeviceMesh::size() const { return numel_of(state().shape); }
const std::vector<std::string>& DeviceMesh::axis_names() const { return state().names; }

int64_t DeviceMesh::axis(const std::string& name) const {
  const auto& names = state().names;
  auto it = std::find(names.begin(), names.end(), name);
  QUILT_CHECK(it != names.end(), "[device_mesh] no axis '", name, "' in ", str());
  return int64_t(it - names.begin());
}

const Shape& DeviceMesh::coordinate() const { return state().coord; }
int64_t DeviceMesh::coordinate(int64_t axis) const {
  return state().coord[size_t(wrap_dim(axis, ndim(), "device_mesh"))];
}
int DeviceMesh::rank() const { return state().comm->rank(); }
Communicator& DeviceMesh::comm() const { return *state().comm; }
Communicator& DeviceMesh::comm(int64_t axis) const { return *comm_ptr(axis); }
std::shared_ptr<Communicator> DeviceMesh::comm_ptr(int64_t axis) const {
  return state().axis_comms[size_t(wrap_dim(axis, ndim(), "device_mesh"))];
}
const std::vector<int>& DeviceMesh::ranks() const { return state().ranks; }
std::shared_ptr<Communicator> DeviceMesh::root_comm() const { return state().root_comm; }

DeviceMesh DeviceMesh::operator[](const std::string& name) const { return sub({name}); }
DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const { return flatten(names); }

DeviceMesh DeviceMesh::sub(const std::vector<std::string>& names) const {
  QUILT_CHECK(!names.empty(), "[device_mesh] a sub-mesh needs at least one axis name");
  std::vector<int64_t> axes;
  for (const auto& n : names) axes.push_back(axis(n));
  std::sort(axes.begin(), axes.end());
  QUILT_CHECK(std::adjacent_find(axes.begin(), axes.end()) == axes.end(), "[device_mesh] axis named twice in (",
              join(names, ", "), ")");
  if (int64_t(axes.size()) == ndim()) return *this;
  MeshState& s = *state_;
  std::string key = "sub:";
  for (int64_t a : axes) key += s.names[size_t(a)] + ",";
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.children.find(key);
    if (it != s.children.end()) return DeviceMesh(it->second);
  }
  auto c = std::make_shared<MeshState>();
  c->root = s.root;
  c->root_comm = s.root_comm;
  for (int64_t a : axes) {
    c->shape.push_back(s.shape[size_t(a)]);
    c->names.push_back(s.names[size_t(a)]);
    c->coord.push_back(s.coord[size_t(a)]);
    c->axis_comms.push_back(s.axis_comms[size_t(a)]);
  }
  c->ranks = ranks_along(s, axes);
  if (axes.size() == 1) {
    c->comm = s.axis_comms[size_t(axes[0])];
  } else {
    Shape rest_shape, rest_coord, keep_shape;
    for (int64_t b = 0; b < ndim(); ++b)
      if (std::find(axes.begin(), axes.end(), b) == axes.end()) {
        rest_shape.push_back(s.shape[size_t(b)]);
        rest_coord.push_back(s.coord[size_t(b)]);
      }
    c->comm = s.comm->split(int(ravel(rest_coord, rest_shape)), int(ravel(c->coord, c->shape)));
    std::string axis;
    for (const std::string& n : c->names) axis += (axis.empty() ? "" : "*") + n;
    c->comm->set_axis(axis);
  }
  std::lock_guard<std::mutex> lock(s.mu);
  return DeviceMesh(s.children.emplace(key, c).first->second);
}

DeviceMesh DeviceMesh::flatten(const std::vector<std::string>& names, const std::string& new_name) const {
  QUILT_CHECK(!names.empty(), "[device_mesh] flatten needs at least one axis name");
  const std::string name = new_name.empty() ? join(names, "_") : new_name;
  std::vector<int64_t> axes;
  for (const auto& n : names) axes.push_back(axis(n));
  for (size_t i = 1; i < axes.size(); ++i)
    QUILT_CHECK(axes[i] > axes[i - 1], "[device_mesh] flatten takes axes in mesh order, got (", join(names, ", "),
                ") of ", str());
  MeshState& s = *state_;
  const std::string key = "flat:" + join(names, ",") + "->" + name;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.children.find(key);
    if (it != s.children.end()) return DeviceMesh(it->second);
  }
  DeviceMesh part = sub(names);  // the communicator over exactly these positions
  const MeshState& p = *part.state_;
  auto c = std::make_shared<MeshState>();
  c->root = s.root;
  c->root_comm = s.root_comm;
  c->shape = {numel_of(p.shape)};
  c->names = {name};
  c->coord = {ravel(p.coord, p.shape)};
  c->ranks = p.ranks;
  c->comm = p.comm;
  c->axis_comms = {p.comm};
  std::lock_guard<std::mutex> lock(s.mu);
  return DeviceMesh(s.children.emplace(key, c).first->second);
}

std::string DeviceMesh::str() const {
  if (!state_) return "DeviceMesh(undefined)";
  std::string out = "DeviceMesh(";
  for (size_t i = 0; i < state_->shape.size(); ++i)
    out += (i ? ", " : "") + state_->names[i] + "=" + std::to_string(state_->shape[i]);
  return out + ")";
}

bool operator==(const DeviceMesh& a, const DeviceMesh& b) {
  if (a.state_ == b.state_) return true;
  if (!a.state_ || !b.state_) return false;
  return a.state_->root == b.state_->root && a.state_->shape == b.state_->shape &&
         a.state_->names == b.state_->names && a.state_->ranks == b.state_->ranks;
}

}  // namespace quilt
