"""Billing's management API (docs/billing.md), a module per resource: the price book
(operators), a tenant's usage, spend and cap, invoices and exports, and the usage reports
the ledger refused (operators).

Every operation looks the tenant up first (another tenant's is 404), then checks
the action (403), then validates its input (400): a refused call changes nothing.
"""
