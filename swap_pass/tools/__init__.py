"""The ``swap-pass`` commands and what they run: demo, plan, bench, capacity, bundled models.

Not part of what ``import swap_pass`` loads: these modules use the library as a user does.
"""
