"""Reading what a compiled program sends: where each value flows, what a collective serves and feeds.

Each collective becomes report rows with the parameter it serves.
"""
