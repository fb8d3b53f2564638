"""k8s placeholder"""
