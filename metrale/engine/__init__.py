"""metrale.engine"""
