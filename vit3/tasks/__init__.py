"""vit3.tasks"""
