"""The detectors of waste in a compiled step, and the findings they make, costliest first.

Each detector reads the rows, the flow and the uses; none compiles anything.
"""
