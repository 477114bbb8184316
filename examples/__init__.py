"""Example LightningModules written for one device: no parallel code in them."""
