"""A throughput priced per 1k rows (money as every report writes it is the kernel's ``shardline.figures.money``).

The price table itself (``PriceTable``, ``load_prices``, ``prices_path``) is ``shardline.capacity.prices``: the
packer prices its hardware from it too.
"""

from __future__ import annotations

from shardline.errors import InvalidSetting


def cost_per_1k_rows(price_per_hour: float, rows_per_s: float) -> float:
    """What scoring 1,000 rows costs on one unit priced ``price_per_hour`` that scores ``rows_per_s``:
    ``price_per_hour / 3600 / rows_per_s * 1000`` (the unit's time the rows take, priced)."""
    if rows_per_s <= 0:
        raise InvalidSetting(f"a throughput must be positive to price, got {rows_per_s} rows/s")
    return price_per_hour / 3600 / rows_per_s * 1_000
