"""Settings every test module shares; pytest loads this file before any test module.

The shared helpers are plain modules, imported by name (pytest puts tests/ on `sys.path`), each helper defined
once:

* `inputs`: seeded random token ids and prompts, left padding, a first call's output extended by suffixes;
* `tolerances`: fp32 tolerances derived from eps, depth and reduction width;
* `helpers`: tiny Ouro configs (`tiny_config`, which every tiny Ouro model starts from) and models, Hub-named
  weights, the Ouro reference, Hub-like folders;
* `huginn_utils`: the same for Huginn;
* `speculative_utils`: the speculative mode matrix (`MODES`; `MODE_PAIR`, one setting per mode, for tests whose
  subject is not the schedule; `mode_params` turns the matrix, a filter or a map of it into pytest parameters, and
  `named_modes` gives generate's arguments by name, plain included), tiny Ouro models and cases for speculation,
  the identity matrix's batch shapes, the plain and speculative decoding calls (Ouro and Huginn), counters,
  forced-run, I4 and trace checks;
* `paged_utils`: a small KV layout, rows planned and values written and read through a `PagedLoopCache`'s block
  tables (the cache unit tests and the I4 check);
* `recorders`: a streamer and a stopping criterion that record what `generate` hands them;
* `sampling_utils`: the statistics of the speculative sampling tests (their model is the `sampling_model` fixture
  below);
* `differential`: the randomized differential comparison of speculative with plain greedy decoding (seeded cases
  over the settings space, the near-tie bound of a divergence), run by `test_differential.py` and, with many more
  seeds, by `scripts/differential_soak.py`;
* `continuous_utils`: continuous batching's request settings, manager sizes, the reference of one request (plain
  decoding of it alone) and the collection of a manager's results;
* `checkpoint_utils`: tiny checkpoint folders with a word-level tokenizer, folder snapshots;
* `cli_utils`: a runnable command line per subcommand and the one error line a failed command prints;
* `processes`: the checkout's root (`ROOT`), the environment of the Python processes tests start, and several CLI
  runs in one fresh process (`cli_runs_in_one_process`: what each run prints is its own).

A file that tests a subset of the matrix derives it from `MODES` (`mode_params(keep=...)`) rather than restating
settings.

Every tiny model's weights come from `hf_loopspec.bench.shapes.random_model`, the one seeded recipe that the
benchmark shapes use too, except the sampling tests' model (`sampling_utils.tiny_sampling_model` says why). A test
that needs a property of its random model (drafts both accepted and rejected, long accepted runs, a token that stops
a row early) asserts it, so a change of the recipe shows up as a failed assertion rather than a silently weaker test.
"""

import pytest
import sampling_utils
import torch

from hf_loopspec.generation.auto_cache import CACHE_ENV

# The test models are tiny: intra-op threads only add overhead (and thrash on a shared machine).
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def stored_costs(tmp_path_factory):
    """Auto's stored cost tables (`generation.auto_cache`) go to a folder of the session, for this process and the
    processes tests start, never to the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("loopspec-cache")))
        yield


@pytest.fixture(scope="module")
def sampling_model():
    """The tiny model of the speculative sampling tests (`sampling_utils.tiny_sampling_model`)."""
    return sampling_utils.tiny_sampling_model()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The tests marked `slow` run first (a stable sort: collection order otherwise): with two xdist workers, a long
    test handed out near the end would leave one worker alone for its whole run. Every worker sorts the same
    collection alike, as xdist requires."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
