"""The search: each candidate's bounds, its compiles most promising first, and the ranked plan.

``plan`` ranks tables by step time; ``plan_batches`` by examples per second at the largest batch.
"""
