"""A compile in a child process: more devices than this machine has, or a target's.

The pipe and its progress, and the user's script run again to find a step defined in it.
"""
