"""asympd: asymmetric prefill/decode disaggregated serving for DeepSeek-V4.1-Flash."""

from asympd.config import ModelConfig

__all__ = ["LLM", "ModelConfig", "SamplingParams", "load_model"]


def __getattr__(name: str):
    # lazy, so `import asympd` stays light (the CLI's memory report needs no model code)
    if name == "SamplingParams":  # lazy too: the router imports asympd and never needs torch
        from asympd.engine.sampling import SamplingParams

        return SamplingParams
    if name == "LLM":
        from asympd.engine.llm import LLM

        return LLM
    if name == "load_model":
        from asympd.model.loader import load_model

        return load_model
    raise AttributeError(name)
