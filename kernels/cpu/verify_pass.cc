// ms_efficient plan-verification pass: a MindSpore 2.10 FULL_GRAPH custom pass that records,
// for every primitive call of the compiled graph, what a plan may have changed there.
//
// Loaded with mindspore.graph.register_custom_pass("ms_efficient_verify", <this .so>,
// device=..., pass_type=CustomPassType.FULL_GRAPH); built and cached by
// ms_efficient/verify/plugin.py. FULL_GRAPH passes run in the frontend after autodiff and after
// MindSpore's recompute insertion, on one graph holding forward (Default/...), backward
// (Gradients/Default/...) and optimizer ops, so the recomputed copies of forward nodes are
// visible here.
//
// A pass stays registered for the whole process and runs on every compile, so it does nothing
// unless the environment variable MS_EFFICIENT_VERIFY_RECORD names a file: then it writes one
// JSON document there (atomically: <path>.tmp then rename), overwriting the previous compile's:
//   {"version": 1, "graph": <root graph name>, "nodes": [
//      {"scope": fullname_with_scope, "op": primitive name,
//       "graph_stage": stage of the FuncGraph holding the node (-1 when unset),
//       "recomputed": true when MindSpore's recompute pass made this node (a duplicated
//                     forward node feeding the backward),
//       "reads_parameter": true when an input is a weight (a Parameter with a default value,
//                     directly or through Load): such nodes carry their Cell's scope even
//                     where MindSpore shares one graph between identical Cells,
//       "ordered": true when an input is a Depend node (a recomputed copy is ordered after
//                     the backward's inputs this way; without one MindSpore warned "Can not
//                     find the nodes to depend" and the copy may run in the forward),
//       "cnode_attrs": {name: value text} for the attributes in kCNodeAttrs,
//       "prim_attrs": {name: value text} for the primitive attributes in kPrimAttrs,
//       "inputs": [[shape text, type text], ...] of the node's inputs as inferred
//                 (e.g. ["(32, 16)", "Tensor[Float32]"]; "" where an input has none),
//       "output": [shape text, type text]}, ...]}
// (the shapes are what the traffic audit reads: the collectives' operands.)
// The pass never changes the graph (Run returns false).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "mindspore/include/custom_pass_api.h"
#include "mindspore/core/include/ir/func_graph.h"
#include "mindspore/core/include/ir/graph_utils.h"
#include "mindspore/core/include/abstract/abstract_value.h"
#include "nlohmann/json.hpp"

namespace {

constexpr const char *kRecordEnv = "MS_EFFICIENT_VERIFY_RECORD";
constexpr const char *kPassName = "ms_efficient_verify";

// CNode attributes MindSpore's recompute and pipeline passes set or read.
const std::vector<std::string> kCNodeAttrs = {
    "recompute", "duplicated", "need_cse_after_recompute", "recompute_sub_graph", "stage",
    "pipeline_begin", "pipeline_end", "micro", "offload", "backward_prefetch"};
// Primitive attributes plans set: Primitive.shard (strategies, layouts), Cell.recompute,
// Cell.offload (offload, backward_prefetch).
const std::vector<std::string> kPrimAttrs = {"in_strategy", "out_strategy", "in_layout", "out_layout",
                                             "recompute", "stage", "offload", "backward_prefetch",
                                             "group"};

bool IsWeight(const mindspore::AnfNodePtr &node) {
  auto param = node->cast<mindspore::ParameterPtr>();
  return param != nullptr && param->has_default();
}

bool ReadsParameter(const mindspore::CNodePtr &cnode) {
  for (size_t i = 1; i < cnode->size(); ++i) {
    const auto &input = cnode->input(i);
    if (IsWeight(input)) {
      return true;
    }
    auto load = input->cast<mindspore::CNodePtr>();
    if (load == nullptr || load->size() < 2 || !IsWeight(load->input(1))) {
      continue;
    }
    auto prim = mindspore::GetCNodePrimitive(load);
    if (prim != nullptr && prim->name() == "Load") {
      return true;
    }
  }
  return false;
}

bool HasDependInput(const mindspore::CNodePtr &cnode) {
  for (size_t i = 1; i < cnode->size(); ++i) {
    auto input = cnode->input(i)->cast<mindspore::CNodePtr>();
    if (input == nullptr) {
      continue;
    }
    auto prim = mindspore::GetCNodePrimitive(input);
    if (prim != nullptr && prim->name() == "Depend") {
      return true;
    }
  }
  return false;
}

nlohmann::json PickAttrs(const mindspore::HashMap<std::string, mindspore::ValuePtr> &attrs,
                         const std::vector<std::string> &names) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto &name : names) {
    auto it = attrs.find(name);
    if (it != attrs.end() && it->second != nullptr) {
      out[name] = it->second->ToString();
    }
  }
  return out;
}

// [shape text, type text] of a node's inferred abstract, ["", ""] when it has none.
nlohmann::json ShapeAndType(const mindspore::AnfNodePtr &node) {
  nlohmann::json out = nlohmann::json::array({"", ""});
  if (node == nullptr) {
    return out;
  }
  auto abs = node->abstract();
  if (abs == nullptr) {
    return out;
  }
  auto shape = abs->GetShape();
  auto type = abs->GetType();
  out[0] = shape == nullptr ? "" : shape->ToString();
  out[1] = type == nullptr ? "" : type->ToString();
  return out;
}

class VerifyRecordPass : public mindspore::opt::Pass {
 public:
  VerifyRecordPass() : Pass(kPassName) {}

  bool Run(const mindspore::FuncGraphPtr &func_graph) override {
    const char *path = std::getenv(kRecordEnv);
    if (path == nullptr || path[0] == '\0' || func_graph == nullptr) {
      return false;
    }
    nlohmann::json nodes = nlohmann::json::array();
    auto order = mindspore::TopoSort(func_graph->get_return(), mindspore::SuccDeeperSimple);
    for (const auto &node : order) {
      auto cnode = node->cast<mindspore::CNodePtr>();
      if (cnode == nullptr) {
        continue;
      }
      auto prim = mindspore::GetCNodePrimitive(cnode);
      if (prim == nullptr) {
        continue;
      }
      nlohmann::json row;
      row["scope"] = cnode->fullname_with_scope();
      row["op"] = prim->name();
      auto graph = cnode->func_graph();
      row["graph_stage"] = graph == nullptr ? -1 : graph->stage();
      row["recomputed"] = cnode->HasAttr("duplicated");
      row["reads_parameter"] = ReadsParameter(cnode);
      row["ordered"] = HasDependInput(cnode);
      row["cnode_attrs"] = PickAttrs(cnode->attrs(), kCNodeAttrs);
      row["prim_attrs"] = PickAttrs(prim->attrs(), kPrimAttrs);
      nlohmann::json inputs = nlohmann::json::array();
      for (size_t i = 1; i < cnode->size(); ++i) {
        inputs.push_back(ShapeAndType(cnode->input(i)));
      }
      row["inputs"] = inputs;
      row["output"] = ShapeAndType(cnode);
      nodes.push_back(row);
    }
    nlohmann::json doc;
    doc["version"] = 1;
    doc["graph"] = func_graph->ToString();
    doc["nodes"] = nodes;
    const std::string target(path);
    const std::string tmp = target + ".tmp";
    {
      std::ofstream out(tmp);
      if (!out) {
        MS_LOG(EXCEPTION) << kPassName << ": cannot write the record file " << tmp;
      }
      out << doc.dump();
    }
    if (std::rename(tmp.c_str(), target.c_str()) != 0) {
      MS_LOG(EXCEPTION) << kPassName << ": cannot rename " << tmp << " to " << target;
    }
    return false;
  }
};

class VerifyPlugin : public mindspore::opt::CustomPassPlugin {
 public:
  std::string GetPluginName() const override { return "ms_efficient_verify_plugin"; }
  std::vector<std::string> GetAvailablePassNames() const override { return {kPassName}; }
  std::shared_ptr<mindspore::opt::Pass> CreatePass(const std::string &pass_name) const override {
    if (pass_name != kPassName) {
      return nullptr;
    }
    return std::make_shared<VerifyRecordPass>();
  }
};

}  // namespace

EXPORT_CUSTOM_PASS_PLUGIN(VerifyPlugin)
