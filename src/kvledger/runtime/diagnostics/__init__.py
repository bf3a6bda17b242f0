"""Where did the memory go: four ledgers (tensors, allocator, pool, device) sampled at step boundaries,
reconciled into named causes. See docs/diagnostics.md."""
