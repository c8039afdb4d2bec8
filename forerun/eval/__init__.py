"""Task accuracy (`forerun eval`): a real task's score, plain or speculative, so that a precision or
a drafter can be shown to cost nothing. humaneval.py: HumanEval pass@1; sandbox.py: running a
model's code; report.py: report.json / report.md; command.py: the CLI."""
