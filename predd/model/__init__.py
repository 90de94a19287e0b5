"""The model: loading a checkpoint (GGUF, Hugging Face), the tokenizer, the dtype choice,
the Llama module, and its projections (packed for oneDNN, or computed from the
checkpoint's quantised blocks, with their calibration).

May import: torch, numpy, gguf, safetensors, tokenizers, jinja2; predd.kernels; predd.memory's
huge pages.
"""
