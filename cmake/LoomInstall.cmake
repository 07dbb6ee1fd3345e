include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS loom EXPORT loomTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/loom DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT loomTargets NAMESPACE loom:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/loom)

configure_package_config_file(cmake/loomConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/loomConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/loom)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/loomConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/loomConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/loomConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/LoomTorchIncludes.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/loom)
