// A device-ordered completion: work queued on a device (a collective on a
// communication stream, a kernel on a compute stream) is done only when the
// device reaches it, which the host learns from an event recorded after it.
// A communication Work carries one when its backend completes on a device;
// a compute backend with a stream of its own orders that stream after the
// event instead of blocking the host (Backend::order_after). Host backends
// (MPI, the CPU backend) carry and need none.
//
// Buffers: a consumer that orders itself after an event frees the buffers it
// read right after queueing the reads (ZeRO's gathered units, its reduced
// gradient buffers). A backend with a stream therefore frees its Buffers in
// stream order (the memory is reused only after the operations queued
// before the free have run), as a stream-ordered allocator does.
#pragma once

#include "loom/core/memory.h"

namespace loom {

class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  virtual Device device() const = 0;
  // True once the device has passed the event.
  virtual bool query() const = 0;
  // Blocks the host until it has.
  virtual void synchronize() const = 0;
};

}  // namespace loom
