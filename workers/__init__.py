"""Engine workers: request state, paged KV cache, scheduler, model runner and the engine loop."""
