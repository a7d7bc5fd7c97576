"""What the metering ledger's use cost: prices, allocation, the chargeback report (``cost/README.md``)."""
