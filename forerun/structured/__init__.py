"""Structured outputs: a request's JSON schema, regex, choice or grammar, enforced token by token.

spec.py      StructuredOutputs: the constraint (vLLM's StructuredOutputsParams shape)
request.py   OpenAI response_format / vLLM structured_outputs and guided_* fields -> StructuredOutputs
grammar.py   GrammarCompiler: compile once per constraint and tokenizer (llguidance), cached
matcher.py   RowMatcher: one row's state: masks, advance, rollback, forced runs, draft checks

llguidance is imported only when a grammar is compiled, so `import forerun` stays light.
"""
from forerun.structured.grammar import CompiledGrammar, GrammarCompiler, UnenforcedKeyword
from forerun.structured.matcher import RowMatcher, fill_masks
from forerun.structured.request import from_request, from_response_format, from_structured_outputs
from forerun.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs", "from_request", "from_response_format", "from_structured_outputs",
           "GrammarCompiler", "CompiledGrammar", "UnenforcedKeyword", "RowMatcher", "fill_masks"]
