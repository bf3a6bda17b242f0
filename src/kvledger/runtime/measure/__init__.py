"""The measuring room: what the runtime measures about itself, apart from what it runs.

- :mod:`.diagnostics` -- memory diagnostics: four byte ledgers (tensors, allocator, device, the KV pool)
  read at the engine's step boundaries and reconciled (``kvledger diagnose``; docs/diagnostics.md);
- :mod:`.quality` and :mod:`.quality_records` -- a quantised KV format measured against the uncompressed
  KV of the same model, its contract and the records that let an engine use it (``kvledger quality``;
  docs/kv_formats.md);
- :mod:`.links` -- the copy links below the device pool (host, disk), timed for ``kvledger calibrate``;
- :mod:`.corpus` -- the bundled text that measurements and trace replays take their prompt tokens from.

It sits on top of the rest of the runtime (the engine, the model runner, the KV stores, the transfers),
which imports nothing from here but one thing: the engine asks :func:`.quality_records.require_record`
before it runs a quantised KV format. Nothing is imported by ``import kvledger.runtime.measure``.
"""
