"""The tables a plan chooses from: each weight's role read from the step, and the strategies.

Data parallel, FSDP, tensor parallel and hybrids, by name or derived from the roles.
"""
