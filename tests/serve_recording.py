"""transformers >= 5.25 serves each model in a process of its own: `RecordingLoader` (the loader that process
receives, pickled) records there, as JSON lines in a file, every speculative `generate` and the continuous-batching
manager's mode and accepted drafts, for `test_serve` to read."""

from __future__ import annotations

import json

from hf_loopspec.serving_engine import LoopModelLoader


class RecordingLoader(LoopModelLoader):
    path = None  # set by the test before the server starts; copied onto each instance, which travels pickled

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_path = RecordingLoader.path

    def load_model_and_processor(self, model_id, on_progress=None):
        from hf_loopspec.generation import mixin
        from hf_loopspec.generation.continuous.manager import LoopBatchingManager
        from hf_loopspec.generation.wavefront.state import COUNTERS

        path = self.record_path

        def write(record):
            with open(path, "a") as file:
                file.write(json.dumps(record) + "\n")

        original, original_get = mixin.run_speculative, LoopBatchingManager.get_result

        def recording(model, request):
            write({"spec": [request.spec.mode, request.spec.draft_loops, request.spec.num_speculative_tokens]})
            return original(model, request)

        def recording_get(manager, *args, **kwargs):
            result = original_get(manager, *args, **kwargs)
            if result is not None and manager.batch_processor is not None:
                accepted = int(manager.batch_processor.state.counters[:, COUNTERS.index("accepted")].sum())
                write({"manager": manager.settings.mode, "accepted": accepted})
            return result

        mixin.run_speculative, LoopBatchingManager.get_result = recording, recording_get
        return super().load_model_and_processor(model_id, on_progress)
