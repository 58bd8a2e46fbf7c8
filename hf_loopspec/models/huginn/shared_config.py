"""The Huginn causal LM's generation config, which its base model (`transformer`) holds too: the config's recurrence
settings are the base model's defaults outside any `recurrence` block (`HuginnModel.defaults`), so that `forward`,
`num_loops` and `kv_layout` agree with what `generate` runs."""

from __future__ import annotations


class SharedGenerationConfig:
    """`generation_config` as a property whose setter (transformers sets it when the model is built and loaded) puts
    the same object on the base model; edits to the object reach both."""

    @property
    def generation_config(self):
        return self.__dict__.get("_generation_config")

    @generation_config.setter
    def generation_config(self, config) -> None:
        self.__dict__["_generation_config"] = config
        if "transformer" in self._modules:
            self.transformer.__dict__["generation_config"] = config

    def __setstate__(self, state: dict) -> None:
        """A model pickled whole (`torch.save(model)`) by a version without the property kept its config under the
        attribute's own name: it is moved to the property, and so shared again."""
        super().__setstate__(state)
        if "generation_config" in self.__dict__:
            self.generation_config = self.__dict__.pop("generation_config")
