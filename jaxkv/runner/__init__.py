"""The device side of a step: ``ModelRunner`` (params, the donated KV cache, the jitted step),
the host batch it is fed, the step function, sharding over a mesh, the memory plan that sizes
the pool, and the runner's helpers (compilation cache, huge pages)."""
