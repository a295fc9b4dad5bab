"""`sluice bench`: open-loop load experiments against an engine or a gateway, their reports and plots."""
