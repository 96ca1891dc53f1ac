"""Values and pure functions every layer reads: hosts, addresses, reasons, the contract. Imports nothing of egress."""
