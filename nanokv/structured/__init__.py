"""vLLM's structured outputs (guided decoding): `StructuredOutputsParams` says what the output
must be (a JSON schema, a regex, a choice, a grammar); `xgrammar_backend` (the optional
[structured] extra) compiles it and masks each step's disallowed tokens."""

from nanokv.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
