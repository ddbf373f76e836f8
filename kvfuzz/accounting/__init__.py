"""Memory accounting: the exact arithmetic of paging versus fixed reservation, and the live occupancy of a pool.

Positions, blocks and bytes are counted separately and never merged into one "memory" figure: K/V bytes exclude block
tables, workspace and padding, and block-table bytes are stated per entry size.
"""

from kvfuzz.accounting.arithmetic import (
    KVShape,
    Layout,
    ReservationTooSmall,
    account,
    allocated_positions,
    paged_layout,
    reserved_layout,
    tail_waste,
)
from kvfuzz.accounting.occupancy import Occupancy, OccupancyLog, OccupancySummary, measure

__all__ = [
    "KVShape",
    "Layout",
    "Occupancy",
    "OccupancyLog",
    "OccupancySummary",
    "ReservationTooSmall",
    "account",
    "allocated_positions",
    "measure",
    "paged_layout",
    "reserved_layout",
    "tail_waste",
]
