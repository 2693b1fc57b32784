"""Running Dispatch as several processes behind nginx (docs/deploy.md); never imported by the apps."""
