"""metrale.model_engine"""
