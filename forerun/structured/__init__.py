"""Structured outputs: a request's JSON schema, regex, choice or grammar, enforced token by token.

spec.py      StructuredOutputs: the constraint (vLLM's StructuredOutputsParams shape)
request.py   OpenAI response_format / vLLM structured_outputs and guided_* fields -> StructuredOutputs
"""
from forerun.structured.request import from_request, from_response_format, from_structured_outputs
from forerun.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs", "from_request", "from_response_format", "from_structured_outputs"]
