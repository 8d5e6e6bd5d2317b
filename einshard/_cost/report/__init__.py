"""The step report: its rows, findings and totals, its estimate at some figures, and its text.

What the readers and detectors below fill in, and what a user reads.
"""
