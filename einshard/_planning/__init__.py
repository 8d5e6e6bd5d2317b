"""The planner: ready-made and derived tables, and the search that ranks them by compiled cost.

``tables`` holds the strategies and the roles they are derived from; ``search`` compiles and ranks.
"""
