#pragma once
// Splitting a model's layers into pipeline stages. Each layer has a cost (time at speed 1, and
// bytes); the first stage also pays for the embedding and the last for the head and loss. The
// partitioner picks contiguous stages that make the slowest stage as fast as possible, where a
// stage's time is its cost divided by the speed of the rank that runs it, and every rank's
// stages must fit its memory. On a heterogeneous cluster (a device file gives each pipeline
// rank a relative speed and a memory size) faster ranks therefore get more layers.
#include <cstdint>
#include <string>
#include <vector>

#include "loom/parallel/pipeline/schedule.h"

namespace loom::parallel::pipeline {

// One pipeline rank's device, relative to the others.
struct DeviceSpec {
  std::string name = "device";
  double speed = 1.0;    // relative throughput: 2 runs a layer in half the time
  double memory_gb = 0;  // what a stage may use there (GiB); 0: no limit
};

// Reads a device file: JSON {"devices": [{"name": "h100", "speed": 2.0, "memory_gb": 80}, ...]},
// one entry per pipeline rank in pipeline order ("name" and "memory_gb" optional). A missing
// file, bad JSON, a count other than `pp` or a speed <= 0 is a loom::Error naming the file.
std::vector<DeviceSpec> load_device_file(const std::string& path, int64_t pp);
// Whether `path` is a readable file holding a device file's JSON (an object whose "devices"
// have a "speed"), without checking it further.
bool is_device_file(const std::string& path);
// `pp` equal devices.
std::vector<DeviceSpec> uniform_devices(int64_t pp);

// What the partitioner balances.
struct LayerCosts {
  std::vector<double> layer_time;   // per layer (any unit, at speed 1)
  std::vector<double> layer_bytes;  // per layer: parameters, their training state, activations
  double first_time = 0, first_bytes = 0;  // the embedding, on the first stage
  double last_time = 0, last_bytes = 0;    // the final norm, head and loss, on the last stage
  std::string kind = "uniform";            // what the costs measure, for the log
};

struct Partition {
  PipelineShape shape;
  std::vector<DeviceSpec> devices;  // per pipeline rank
  std::vector<int64_t> bounds;      // stages + 1: stage s holds layers [bounds[s], bounds[s+1])
  std::vector<double> time;         // predicted per stage: its cost / its rank's speed
  std::vector<double> bytes;        // predicted per stage

  int64_t first_layer(int64_t stage) const { return bounds[static_cast<size_t>(stage)]; }
  int64_t end_layer(int64_t stage) const { return bounds[static_cast<size_t>(stage) + 1]; }
  int64_t layers(int64_t stage) const { return end_layer(stage) - first_layer(stage); }
  // The slowest stage's predicted time over the mean: 1 is perfect balance.
  double imbalance() const;
  // One line per stage: rank, device, layers, predicted time and memory.
  std::string describe() const;
};

// Splits costs.layer_time.size() layers into shape.stages() contiguous stages of at least one
// layer each (stage s on rank shape.rank_of(s)), minimizing the largest stage time. A rank with
// v chunks gives each 1/v of its memory. No partition that fits is a loom::Error naming the
// memory each rank would need at best.
Partition partition_layers(const LayerCosts& costs, const PipelineShape& shape,
                           const std::vector<DeviceSpec>& devices);
// The same split of layers as evenly as counts allow (earlier stages take the remainder),
// whatever the costs; still predicts each stage's time and memory from them.
Partition uniform_partition(const LayerCosts& costs, const PipelineShape& shape,
                            const std::vector<DeviceSpec>& devices);

}  // namespace loom::parallel::pipeline
