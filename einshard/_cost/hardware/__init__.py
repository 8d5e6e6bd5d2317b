"""The hardware and its prices: targets, their figures, the devices' links and a collective's time.

Also the simulated step time, a program's kernels and collectives walked in order at those prices.
"""
