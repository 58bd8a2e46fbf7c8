"""Continuous batching on the wavefront engine (`manager.LoopBatchingManager`, `model.init_continuous_batching`)."""
